"""MultiModalConfig: the multimodal knobs of EngineArgs, resolved."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lm_console.engine.config.fields import DeclaredConfig, knob

MMHasherAlgorithm = Literal["auto", "blake3", "sha256", "sha512"]


@dataclass(slots=True)
class MultiModalConfig(DeclaredConfig):
    """Processor cache, hashing and encoder budget settings shared by P0 and P1."""

    mm_processor_cache_gb: float = knob(
        1.0, ge=0.0, cli=None, help="GiB of each of the P0/P1 processor-output LRU pair; 0 disables it.")
    mm_hasher_algorithm: MMHasherAlgorithm = knob(
        "auto", cli=None, help="Content hash of images: auto (blake3 if installed, else sha256) | blake3 | sha256 | "
                               "sha512.")
    disable_chunked_mm_input: bool = knob(
        False, cli=None, help="Never split one image's placeholder tokens over steps.")
    encoder_cache_size: int | None = knob(
        None, ge=1, cli=None, help="Embeddings the encoder cache holds (default: the step's token budget).")
    max_num_encoder_input_tokens: int | None = knob(
        None, ge=1, cli=None, help="Embeddings encoded per step (default: the step's token budget).")

    @property
    def processor_cache_bytes(self) -> int:
        return int(self.mm_processor_cache_gb * (1 << 30))

    def verify(self) -> None:
        """Resolve mm_hasher_algorithm "auto" (blake3 only where it is installed)."""
        from lm_console.engine.multimodal.hasher import verify_algorithm

        self.mm_hasher_algorithm = verify_algorithm(self.mm_hasher_algorithm)  # type: ignore[assignment]
