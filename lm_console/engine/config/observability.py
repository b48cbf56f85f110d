"""ObservabilityConfig: where request traces go (OpenTelemetry over OTLP, as vLLM's flag names it)."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from lm_console.engine.config.fields import DeclaredConfig, knob
from lm_console.engine.errors import InvalidEngineArgsError

# What tracing imports: the SDK (tracer provider, batch span processor) and the OTLP/HTTP exporter.
OTEL_MODULES = ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter")
OTEL_INSTALL_HINT = "pip install 'lm-console[otel]'"


def otel_missing() -> str | None:
    """The first OpenTelemetry module tracing needs that is not installed, else None."""
    for name in OTEL_MODULES:
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except ModuleNotFoundError:  # a parent package is missing
            return name
    return None


@dataclass(frozen=True)
class ObservabilityConfig(DeclaredConfig):
    """Request tracing: with otlp_traces_endpoint set, one span ("llm_request") per finished
    request is exported there over OTLP/HTTP (protobuf), e.g. http://collector:4318/v1/traces
    (the exporter posts to this URL as given)."""

    otlp_traces_endpoint: str | None = knob(
        None, cli=None,
        help="OTLP/HTTP URL for one span per finished request (e.g. http://localhost:4318/v1/traces); "
             "needs the otel extra (lmc serve --otlp-traces-endpoint).")

    @classmethod
    def verify_relations(cls, values: Mapping[str, Any]) -> None:
        """An http(s) URL with a host, and OpenTelemetry installed."""
        endpoint = values.get("otlp_traces_endpoint")
        if endpoint is None:
            return
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidEngineArgsError(
                f"otlp_traces_endpoint={endpoint!r} is invalid: traces are exported over OTLP/HTTP, so it must be "
                "an http:// or https:// URL with a host, e.g. http://localhost:4318/v1/traces.")
        missing = otel_missing()
        if missing is not None:
            raise InvalidEngineArgsError(
                f"otlp_traces_endpoint is set but OpenTelemetry is not installed ({missing} is missing): "
                f"install the otel extra ({OTEL_INSTALL_HINT}) or leave the endpoint unset.")

    @property
    def tracing_enabled(self) -> bool:
        return self.otlp_traces_endpoint is not None
