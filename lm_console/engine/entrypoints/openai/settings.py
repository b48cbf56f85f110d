"""ServerSettings: everything `lmc serve` configures about the HTTP server (not the engine)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from lm_console.engine.sampling_params import PoolingParams


@dataclass(frozen=True)
class ServerSettings:
    """The server's knobs; every limit here is enforced with a clear error, never silently.

    served_model_names: the names /v1/models lists and `model` may take (the first is the
    default and the metrics' model_name label); empty means the engine's model name.
    """

    host: str = "127.0.0.1"
    port: int = 8000  # 0: an ephemeral port (printed at start-up)
    api_key: str | None = None
    served_model_names: tuple[str, ...] = ()
    allowed_local_media_path: Path | None = None  # file:// image URLs only under this directory
    max_request_body: int = 32 << 20  # bytes; larger bodies get 413 before they are read
    shutdown_timeout_s: float = 10.0  # drain: in-flight requests get this long, then are aborted
    dead_exit_delay_s: float = 2.0  # engine death: keep answering 503 this long, then exit
    media_fetch_timeout_s: float = 10.0  # http(s) image URLs: the whole fetch, redirects included
    max_media_bytes: int = 20 << 20  # one image, fetched or read from file://
    # Image URLs that resolve to loopback, private, link-local or otherwise non-public addresses
    # are refused (a client must not make the server probe its own network) unless this is set.
    allow_private_media_urls: bool = False
    max_image_pixels: int = 6000 * 6000  # width x height, read from the header before any decode
    header_timeout_s: float = 10.0  # a request's headers must arrive within this (else the connection closes)
    body_timeout_s: float = 60.0  # ... and its body within this after them (else 408)
    # The most token entries one request may ask for: for each prompt, n x max_tokens x (1 + logprobs)
    # plus its prompt tokens x (1 + prompt_logprobs); what bounds the work and the response size.
    max_request_work: int = 2_000_000
    max_structured_output_bytes: int = 64 << 10  # one constraint's text (schema, regex, grammar, choices)
    max_structured_output_choices: int = 1024
    max_logprobs: int = 20  # vLLM's default max_logprobs
    max_stop_strings: int = 64
    max_n: int = 128
    max_prompts: int = 256  # prompts in one /v1/completions request
    log_level: str = "info"
    # tool_choice "auto": vLLM's --enable-auto-tool-choice and --tool-call-parser (tool_parsers.py)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # /v1/embeddings: vLLM's --pooler-config (pooling_type LAST or MEAN, normalize)
    pooler_config: PoolingParams = field(default_factory=PoolingParams)
    # (name, adapter directory) of each --lora-modules adapter, chosen by a request's `model`
    lora_modules: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}.")
        for name in ("max_request_body", "max_media_bytes", "max_logprobs", "max_stop_strings", "max_n",
                     "max_prompts", "max_image_pixels", "max_request_work", "max_structured_output_bytes",
                     "max_structured_output_choices"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        for name in ("shutdown_timeout_s", "dead_exit_delay_s", "media_fetch_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}.")
        for name in ("header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}.")
        if self.tool_call_parser is not None:
            from lm_console.engine.entrypoints.openai.tool_parsers import TOOL_PARSERS

            if self.tool_call_parser not in TOOL_PARSERS:
                raise ValueError(f"tool_call_parser {self.tool_call_parser!r} is unknown; known: "
                                 f"{', '.join(sorted(TOOL_PARSERS))}.")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser (--tool-call-parser hermes).")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset for an open server).")
