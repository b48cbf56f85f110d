"""FrontendConfig: how the frontend runs its engine core and talks to it.

The frontend's clients read these from EngineArgs (engine_process.py, mp_client.py,
client_factory.py); the class is where they are declared and checked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from lm_console.engine import envs
from lm_console.engine.config.fields import DeclaredConfig, knob


@dataclass(frozen=True)
class FrontendConfig(DeclaredConfig):
    """The engine core's process, its sockets and its heartbeat."""

    multiprocess: bool = knob(
        default_factory=lambda: envs.LMC_MULTIPROCESS.get() != "0", cli=None,
        help="The engine core in its own process (default; $LMC_MULTIPROCESS=0 flips it), or in this one.")
    zmq_transport: Literal["ipc", "tcp"] = knob(
        "ipc", cli=None, help="The frontend-core sockets: ipc (a private 0700 temp dir) | tcp (loopback).")
    kv_events_endpoint: str | None = knob(
        None, cli=None, help="The KV events PUB socket's address, tcp:// or ipc:// (default: a private ipc path).")
    # How long the frontend waits for the engine core's heartbeat before it declares the core
    # unresponsive (EngineUnresponsiveError).
    liveness_timeout_s: float | None = knob(
        30.0, gt=0.0, cli="--liveness-timeout", cli_none=0.0,
        help="Seconds without a heartbeat from the engine core before it is declared dead (a stopped or hung "
             "core: requests then fail with EngineUnresponsiveError and `lmc serve` exits 1); 0: never.")

    @classmethod
    def verify_relations(cls, values: Mapping[str, Any]) -> None:
        """A KV events endpoint is a ZMQ address."""
        from lm_console.engine.errors import InvalidEngineArgsError

        endpoint = values.get("kv_events_endpoint")
        if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://")):
            raise InvalidEngineArgsError(
                f"kv_events_endpoint={endpoint[:80]!r} is invalid: it must be a ZMQ tcp:// (or ipc://) address.")
