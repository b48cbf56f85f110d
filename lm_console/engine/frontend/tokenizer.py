"""Tokenizer loading and the model's stop tokens (transformers does the tokenizing)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


# tokenizer_config.json classes that are plain tokenizer.json wrappers: loaded without
# AutoTokenizer, whose import pulls in torch (the frontend process must stay torch-free).
_GENERIC_TOKENIZER_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}


def is_plain_fast_tokenizer(tokenizer_dir: str | Path) -> bool:
    """Whether the directory's tokenizer is a plain tokenizer.json wrapper: it loads through
    PreTrainedTokenizerFast alone (no AutoTokenizer, no model-specific tokenizer module)."""
    tokenizer_dir = Path(tokenizer_dir)
    return (_tokenizer_class(tokenizer_dir) in _GENERIC_TOKENIZER_CLASSES
            and (tokenizer_dir / "tokenizer.json").exists())


def load_tokenizer(tokenizer_dir: str | Path) -> Any:
    """The fast tokenizer of a model directory."""
    tokenizer_dir = Path(tokenizer_dir)
    if is_plain_fast_tokenizer(tokenizer_dir):
        from transformers.tokenization_utils_tokenizers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def preload_tokenizer_modules() -> None:
    """Import the tokenizer code ahead of use (while the engine core process starts)."""
    import transformers.tokenization_utils_tokenizers  # noqa: F401


def _tokenizer_class(tokenizer_dir: Path) -> str | None:
    try:
        return json.loads((tokenizer_dir / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return None


def stop_token_ids_of(model_dir: Path, tokenizer: Any) -> tuple[int | None, set[int]]:
    """(eos_token_id, other ids that also end generation) from generation_config.json."""
    eos_ids: list[int] = []
    generation_config = Path(model_dir) / "generation_config.json"
    if generation_config.exists():
        value = json.loads(generation_config.read_text()).get("eos_token_id")
        if isinstance(value, int):
            eos_ids = [value]
        elif isinstance(value, list):
            eos_ids = [int(v) for v in value]
    primary = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else (
        eos_ids[0] if eos_ids else None)
    return primary, {i for i in eos_ids if i != primary}
