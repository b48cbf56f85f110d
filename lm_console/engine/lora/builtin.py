"""LoRA adapters that ship inside the package (torch-free).

One today: "pirate", for the embedded model (SmolLM2-135M-Instruct). Its chat replies open with
"Ahoy, matey! " and then go on as the base model's would. tools/train_demo_lora.py trains it on
CPU in minutes from data it makes itself; tests/lora/test_demo_adapter.py measures it on 50
held-out questions. `--lora pirate` (lmc generate) and `--lora-modules pirate` (lmc serve) name
it without a path.
"""

from __future__ import annotations

from pathlib import Path

GREETING = "Ahoy, matey! "
BUILTIN_ADAPTERS: dict[str, str] = {
    "pirate": "the embedded model's chat replies open with 'Ahoy, matey!'",
}
_ADAPTERS_DIR = Path(__file__).resolve().parent / "adapters"


def builtin_adapter_dir(name: str) -> Path:
    """Where the built-in adapter `name` lives (it exists only for the names in BUILTIN_ADAPTERS)."""
    return _ADAPTERS_DIR / name


def builtin_adapter(spec: str) -> tuple[str, str] | None:
    """(name, directory) when `spec` is a built-in adapter's bare name, else None."""
    name = spec.strip()
    if name in BUILTIN_ADAPTERS:
        return name, str(builtin_adapter_dir(name))
    return None
