"""The messages between a MultiprocExecutor and its worker processes, and their codec.

The executor broadcasts an RPCCall to every worker through the shared-memory MessageQueue
(execute_model's carries the SchedulerOutput); a worker answers an RPCReply through its own
response queue when the call asks it to (every rank, or only the output rank). Messages are
msgpack (msgspec) with tensors and arrays as raw frames (engine.ipc's codec): no pickle.

A call names a Worker method, or a module-level function as "module:qualname" that the worker
imports and calls with itself first; lambdas and closures cannot cross a process without
pickle, so collective_rpc refuses them. Torch-free: the core process imports it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import msgspec

import lm_console.engine.model_runner_output as _model_runner_output_module
import lm_console.engine.scheduler_output as _scheduler_output_module
from lm_console.engine.distributed.kv_transfer.output import KVConnectorOutput
from lm_console.engine.ipc import MsgpackDecoder, MsgpackEncoder
from lm_console.engine.model_runner_output import ModelRunnerOutput
from lm_console.engine.lora.request import LoRARequest
from lm_console.engine.multimodal.inputs import MultiModalFeatureSpec
from lm_console.engine.sampling_params import SamplingParams
from lm_console.engine.scheduler_output import SchedulerOutput

# SchedulerOutput and ModelRunnerOutput name these types only for type checkers; msgspec
# resolves a dataclass's annotations in its module's globals when it builds a typed decoder.
setattr(_model_runner_output_module, "KVConnectorOutput", KVConnectorOutput)  # noqa: B010
setattr(_scheduler_output_module, "SamplingParams", SamplingParams)  # noqa: B010
setattr(_scheduler_output_module, "MultiModalFeatureSpec", MultiModalFeatureSpec)  # noqa: B010
setattr(_scheduler_output_module, "LoRARequest", LoRARequest)  # noqa: B010

ALL_RANKS = -1  # reply_rank: every rank answers
NO_REPLY = -2  # reply_rank: no rank answers (execute_model: a failure ends the worker)


class RPCCall(msgspec.Struct, array_like=True, gc=False, tag="call"):
    """Run `method` on every worker; `reply_rank` answers (ALL_RANKS: every rank answers)."""

    call_id: int
    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    reply_rank: int = ALL_RANKS


class ExecuteModelCall(msgspec.Struct, array_like=True, gc=False, tag="exec"):
    """Worker.execute_model(scheduler_output), typed so the SchedulerOutput decodes as itself."""

    call_id: int
    scheduler_output: SchedulerOutput
    reply_rank: int = NO_REPLY


class ShutdownCall(msgspec.Struct, array_like=True, gc=False, tag="stop"):
    """Leave the busy loop."""


WorkerCall = RPCCall | ExecuteModelCall | ShutdownCall


class RPCReply(msgspec.Struct, array_like=True, gc=False, tag="reply"):
    """A worker's answer to call_id: its result, or the failure as "Type: message"."""

    call_id: int
    rank: int
    result: Any = None
    failure: str | None = None


class SampleReply(msgspec.Struct, array_like=True, gc=False, tag="sample"):
    """The output rank's answer to sample_tokens, typed so it decodes as a ModelRunnerOutput."""

    call_id: int
    rank: int
    output: ModelRunnerOutput


WorkerReply = RPCReply | SampleReply


class ReadyInfo(msgspec.Struct, array_like=True, gc=False):
    """A worker's start-up answer on its pipe: its pid and response queue, or why it failed."""

    rank: int
    pid: int
    response_handle: list[Any] | None = None  # message_queue.Handle fields
    failure: str | None = None


def method_name(method: str | Callable[..., Any]) -> str:
    """The wire name of a collective_rpc target; refuses what cannot be named without pickle."""
    if isinstance(method, str):
        return method
    module, qualname = getattr(method, "__module__", None), getattr(method, "__qualname__", "")
    if not module or "<" in qualname or "." in qualname:
        raise TypeError(
            f"collective_rpc over processes takes a Worker method name or a module-level function; "
            f"{method!r} cannot be sent without pickle.")
    return f"{module}:{qualname}"


def resolve_method(target: Any, name: str) -> Callable[..., Any]:
    """The callable a wire name means on `target` (a worker)."""
    if ":" in name:
        module, qualname = name.split(":", 1)
        function = getattr(importlib.import_module(module), qualname)
        return lambda *args, **kwargs: function(target, *args, **kwargs)
    return getattr(target, name)


class WorkerCodec:
    """Encodes and decodes WorkerCall / WorkerReply frames (one instance per thread)."""

    def __init__(self) -> None:
        self.encoder = MsgpackEncoder()
        self.call_decoder = MsgpackDecoder(WorkerCall)
        self.reply_decoder = MsgpackDecoder(WorkerReply)

    def encode(self, message: Any) -> list[Any]:
        return self.encoder.encode(message)

    def decode_call(self, frames: list[Any]) -> Any:
        return self.call_decoder.decode(frames)

    def decode_reply(self, frames: list[Any]) -> Any:
        return self.reply_decoder.decode(frames)
