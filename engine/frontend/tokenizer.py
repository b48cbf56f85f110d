"""Tokenizer loading and the model's stop tokens (transformers does the tokenizing)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_tokenizer(tokenizer_dir: Path) -> Any:
    """The fast tokenizer of a model directory."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


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
