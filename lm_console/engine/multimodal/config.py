"""MultiModalConfig: the multimodal knobs of EngineArgs, resolved."""

from __future__ import annotations

from dataclasses import dataclass

from lm_console.engine.errors import InvalidEngineArgsError


@dataclass(slots=True)
class MultiModalConfig:
    """Processor cache, hashing and encoder budget settings shared by P0 and P1."""

    mm_processor_cache_gb: float = 1.0  # each of the P0/P1 LRU pair; 0 disables it
    mm_hasher_algorithm: str = "auto"  # auto (blake3 if installed) | blake3 | sha256 | sha512
    disable_chunked_mm_input: bool = False  # never split one image's placeholder over steps
    encoder_cache_size: int | None = None  # embeddings the encoder cache holds (default: token budget)
    max_num_encoder_input_tokens: int | None = None  # embeddings encoded per step (same default)

    @property
    def processor_cache_bytes(self) -> int:
        return int(self.mm_processor_cache_gb * (1 << 30))

    def verify(self) -> None:
        from lm_console.engine.multimodal.hasher import verify_algorithm

        if self.mm_processor_cache_gb < 0:
            raise InvalidEngineArgsError(f"mm_processor_cache_gb={self.mm_processor_cache_gb} must be >= 0.")
        for name in ("encoder_cache_size", "max_num_encoder_input_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise InvalidEngineArgsError(f"{name}={value!r} must be an integer >= 1.")
        self.mm_hasher_algorithm = verify_algorithm(self.mm_hasher_algorithm)
