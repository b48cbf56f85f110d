"""RemoteConsoleClient: the ConsoleClient of a running server, over HTTP (`lmc tui --url`).

start() asks GET /lmc/v1/info. An lm-console server answers it, and the console then reads the
server's console stream (SSE, lm_console/engine/entrypoints/console_protocol.py): the engine's own
SchedulerStats at step rate with the block map (its idle snapshots as StatsSnapshot), KV event
batches (rows numbered by the stream's batch seq) and the server's request table.
Any other OpenAI-compatible server (vLLM) is watched through what it publishes: GET /metrics
polled (vLLM names; each poll a StatsSnapshot, counters as deltas) and, with kv_events_endpoint, its ZMQ PUB of KV events.
What such a server does not publish is listed in info.unavailable, and the panels say so.

Requests go through /v1/completions and /v1/chat/completions with SSE; abort closes the stream.
Imports no torch (httpx, msgspec, zmq).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import httpx
import msgspec

from lm_console.client.asyncllm import kv_records_of
from lm_console.client.event_block_map import EventBlockMap
from lm_console.client.openai_http import (
    KEY_HINT, RemoteRequestError, auth_headers, error_message, openai_messages, raise_for_status, sampling_body,
    stream_openai, unreachable,
)
from lm_console.client.sse import iter_sse
from lm_console.client.types import (
    UNAVAILABLE_BLOCK_MAP, UNAVAILABLE_KV_EVENTS, UNAVAILABLE_LATENCY, UNAVAILABLE_REQUESTS, UNAVAILABLE_STEPS,
    EngineInfo,
    EngineUnavailable, GenParams, KVEventRecord, KVEventStreamError, StatsSnapshot, StreamChunk,
)
from lm_console.client.protocol import ClientCapabilities
from lm_console.server_requests import ServerRequests

if TYPE_CHECKING:
    from lm_console.engine.metrics.stats import RequestBlocksState, SchedulerStats

LMC, OPENAI = "lm-console", "openai"
NO_BLOCK_MAP = "no block map from this server (it publishes /metrics only)"
NO_STEPS = "no per-step stats from this server: /metrics polled every {interval:g} s"
NO_KV_EVENTS = ("no KV events from this server: pass --kv-events-endpoint tcp://HOST:PORT "
                "(vLLM publishes them with --kv-events-config)")
NO_KV_EVENTS_LMC = "KV events are off on this server (start it with --kv-events-endpoint)"
NO_METRICS = "no /metrics with vLLM's names on this server: no scheduler stats"
NO_POOL_SIZE = "no block map: the server's /metrics has no cache_config_info num_gpu_blocks"
EVENT_MAP_SOURCE = "cells: hashes in its prefix cache (KV events), not its block ids"
NO_REQUESTS = "the server's requests are not published: this table shows this console's own"
_LOST_HINT = "The server stopped or the network failed; restart the console once the server is back."
STREAM_READ_TIMEOUT_S = 35.0  # the server sends a keep-alive every 10 s: silence this long means it is gone
_SNAPSHOT_DECODER = msgspec.json.Decoder(StatsSnapshot)  # the stream's `snapshot` event, not a step
KNOWN_STREAM_EVENTS = ("hello", "stats", "snapshot", "kv", "requests", "lag", "error")


class RemoteConsoleClient:
    """ConsoleClient over HTTP to `url` (http://HOST:PORT); see the module docstring."""

    def __init__(self, url: str, api_key: str | None = None, kv_events_endpoint: str | None = None,
                 poll_interval_s: float = 1.0, timeout_s: float = 10.0, queue_size: int | None = None) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--url must start with http:// or https://, got {url!r}")
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.zmq_endpoint = kv_events_endpoint
        self.poll_interval_s = poll_interval_s
        self.timeout_s = timeout_s
        self.queue_size = queue_size  # the server-side queue of this console (None: the server's default)
        self.info = EngineInfo(model="?", url=self.url)
        self.mode: str | None = None
        self.served_model = ""
        self.server_kv_events = False
        self.has_metrics = False
        self.server_requests: ServerRequests | None = None
        self.num_dropped_frames = 0  # frames the server dropped for this console (it was slow)
        self.num_kv_gaps = 0  # KV batches lost between two received ones
        self.num_kv_undecodable = 0  # KV event messages that could not be read at all (skipped)
        self.num_kv_unknown = 0  # events of a type this console does not know (shown, counted)
        self.last_kv_decode_error = ""
        # A vLLM server's prefix cache drawn from its KV events (its own block map is not published).
        self.event_map: EventBlockMap | None = None
        self.http: httpx.AsyncClient | None = None
        self._requests: dict[str, asyncio.Task[None]] = {}
        self._closed = asyncio.Event()

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> EngineInfo:
        """Detect the server's kind and read its facts; EngineUnavailable when it cannot be used."""
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s, read=None),
                                      headers=auth_headers(self.api_key))
        try:
            info = await self._get_json_or_none("/lmc/v1/info")
            if info is not None and info.get("server") == LMC:
                await self._start_lmc(info)
            else:
                await self._start_openai()
        except EngineUnavailable as error:
            error.during_start = True
            await self.shutdown()
            raise
        return self.info

    async def _start_lmc(self, info: dict[str, Any]) -> None:
        from lm_console.engine.entrypoints.console_protocol import STREAM_VERSION

        version = int(info.get("stream_version", 0))
        if version > STREAM_VERSION:
            raise EngineUnavailable(f"The server speaks console stream v{version}; this console speaks "
                                    f"v{STREAM_VERSION}.", "Upgrade lm-console on this machine.")
        self.mode = LMC
        self.server_kv_events = bool(info.get("kv_events"))
        self.server_requests = ServerRequests()
        self.served_model = await self._first_model() or str(info.get("model") or "?")
        unavailable = {}
        if not self.server_kv_events and not self.zmq_endpoint:
            unavailable[UNAVAILABLE_KV_EVENTS] = NO_KV_EVENTS_LMC
        self.info = EngineInfo(
            model=self.served_model, device=str(info.get("device", "?")), dtype=str(info.get("dtype", "?")),
            kv_cache_dtype=info.get("kv_cache_dtype"),
            block_size=int(info.get("block_size") or 16), num_blocks=int(info.get("num_blocks") or 0),
            max_model_len=int(info.get("max_model_len") or 0),
            max_num_batched_tokens=int(info.get("max_num_batched_tokens") or 0),
            max_num_seqs=int(info.get("max_num_seqs") or 0), vocab_size=int(info.get("vocab_size") or 32000),
            multimodal=bool(info.get("multimodal")), url=self.url, unavailable=unavailable,
        )

    async def _start_openai(self) -> None:
        from lm_console.client.vllm_metrics import TPOT, parse_metrics, server_figures

        self.mode = OPENAI
        response = await self._request("GET", "/v1/models")
        if response.status_code == 404:
            raise EngineUnavailable(f"{self.url} is not an OpenAI-compatible server: GET /v1/models returned 404.",
                                    "Point --url at the server's root (http://HOST:PORT), without /v1.")
        raise_for_status(self.url, response.status_code, response.content)
        models = response.json().get("data") or []
        if not models:
            raise EngineUnavailable(f"The server at {self.url} serves no model (GET /v1/models is empty).")
        self.served_model = str(models[0].get("id"))
        max_model_len = int(models[0].get("max_model_len") or 0)
        snapshot = None
        with contextlib.suppress(httpx.HTTPError, ValueError):
            metrics = await self._request("GET", "/metrics")
            if metrics.status_code == 200:
                snapshot = parse_metrics(metrics.text)
        self.has_metrics = snapshot is not None and snapshot.is_vllm
        config = snapshot.cache_config if snapshot is not None else {}
        unavailable = {UNAVAILABLE_REQUESTS: NO_REQUESTS,
                       UNAVAILABLE_STEPS: NO_STEPS.format(interval=self.poll_interval_s) if self.has_metrics
                       else NO_METRICS}
        num_blocks = int(float(config.get("num_gpu_blocks") or 0))
        block_map_source = ""
        if not self.zmq_endpoint:
            unavailable[UNAVAILABLE_KV_EVENTS] = NO_KV_EVENTS
            unavailable[UNAVAILABLE_BLOCK_MAP] = NO_BLOCK_MAP
        elif not num_blocks:
            unavailable[UNAVAILABLE_BLOCK_MAP] = NO_POOL_SIZE
        else:
            self.event_map = EventBlockMap(num_blocks)
            block_map_source = EVENT_MAP_SOURCE
        missing = server_figures(snapshot).missing if snapshot is not None and self.has_metrics else []
        if missing:
            unavailable[UNAVAILABLE_LATENCY] = (
                f"no {', '.join(missing)} on this server"
                + (" (vLLM exports request_time_per_output_token_seconds from 0.11 on)" if TPOT in missing else ""))
        self.info = EngineInfo(
            model=self.served_model, device="?", dtype=str(config.get("cache_dtype") or "?"),
            block_size=int(float(config.get("block_size") or 16)),
            num_blocks=num_blocks, max_model_len=max_model_len,
            # Token ids below 1000 exist in any real vocabulary: the load generator stays valid.
            vocab_size=1000, url=self.url, unavailable=unavailable, block_map_source=block_map_source,
        )

    async def shutdown(self) -> None:
        """Detach: end this console's requests and streams (the server keeps running)."""
        self._closed.set()
        for task in list(self._requests.values()):
            task.cancel()
        await asyncio.gather(*self._requests.values(), return_exceptions=True)
        if self.http is not None:
            http, self.http = self.http, None
            await http.aclose()

    @property
    def capabilities(self) -> ClientCapabilities:
        """Over HTTP: no engine-core polls and no tokenizer; an lm-console server's request table."""
        return ClientCapabilities(server_requests=self.server_requests is not None)

    async def request_blocks(self, block_ids: list[int] | None = None) -> RequestBlocksState:
        raise NotImplementedError("a server's engine core is not polled over HTTP (capabilities.request_blocks)")

    def decode_prompt(self, token_ids: list[int]) -> str:
        return ""  # the console holds no tokenizer for a server's model

    @property
    def kv_events_endpoint(self) -> str | None:
        """Where KV events come from, for the panel's subtitle."""
        if self.mode == LMC and self.server_kv_events:
            return f"{self.url}/lmc/v1/stream?topics=kv"
        return self.zmq_endpoint

    # -- streams --------------------------------------------------------------------------
    async def stats_stream(self) -> AsyncIterator[SchedulerStats]:
        if self.mode == LMC:
            async for event, payload in self._console_stream("stats,requests"):
                if event in ("stats", "snapshot"):
                    # Stamped on arrival: the rate windows run on this console's clock, not the server's.
                    payload.timestamp = time.time()
                    yield payload
                elif event == "requests" and self.server_requests is not None:
                    self.server_requests.update(payload, time.time())
            return
        async for sample in self._poll_metrics():
            yield sample

    async def kv_events_stream(self) -> AsyncIterator[list[KVEventRecord]]:
        if self.mode == LMC and self.server_kv_events:
            last_seq = -1
            async for event, payload in self._console_stream("kv"):
                if event == "kv":
                    self._count_gap(last_seq, payload.seq)
                    last_seq = payload.seq
                    records = kv_records_of(payload.batch, payload.seq)
                    self.num_kv_unknown += sum(record.is_unknown for record in records)
                    yield records
            return
        if self.zmq_endpoint:
            async for records in self._zmq_events(self.zmq_endpoint):
                yield records
            return
        await self._closed.wait()  # no source: stay open (an ended stream means a dead engine)

    async def _console_stream(self, topics: str) -> AsyncIterator[tuple[str, Any]]:
        """(event, payload) of the server's console stream; EngineUnavailable when it is lost."""
        from lm_console.engine.entrypoints.console_protocol import STREAM_PATH, decode_event

        params: dict[str, Any] = {"topics": topics}
        if self.queue_size:
            params["queue"] = self.queue_size
        try:
            timeout = httpx.Timeout(self.timeout_s, read=STREAM_READ_TIMEOUT_S)
            async with self._http().stream("GET", self.url + STREAM_PATH, params=params, timeout=timeout) as response:
                if response.status_code != 200:
                    raise_for_status(self.url, response.status_code, await response.aread())
                    raise EngineUnavailable(f"The console stream failed: {error_message(await response.aread(), 400)}")
                async for sse in iter_sse(response.aiter_lines()):
                    if sse.event not in KNOWN_STREAM_EVENTS:
                        continue  # a newer server's event: nothing this console shows
                    try:
                        payload = (_SNAPSHOT_DECODER.decode(sse.data) if sse.event == "snapshot"
                                   else decode_event(sse.event, sse.data))
                    except (ValueError, msgspec.MsgspecError) as error:
                        if sse.event == "kv":  # KV events are monitoring: skip the frame, count it
                            self.num_kv_undecodable += 1
                            self.last_kv_decode_error = str(error)
                            continue
                        raise EngineUnavailable(f"This console cannot read the server's {sse.event!r} frames: {error}",
                                                "Run the same lm-console version here and on the server.") from error
                    if sse.event == "error":
                        message = error_message(sse.data, 503)
                        raise EngineUnavailable(f"The server's engine stopped: {message}",
                                                "Restart the server (its log says why the engine stopped).")
                    if sse.event == "lag":
                        self.num_dropped_frames += payload.num_dropped  # type: ignore[attr-defined]
                    yield sse.event, payload
        except httpx.TransportError as error:
            if self._closed.is_set():
                return
            raise EngineUnavailable(f"Lost the console stream from {self.url}: {type(error).__name__}: {error}",
                                    _LOST_HINT) from error
        if not self._closed.is_set():
            raise EngineUnavailable(f"The server at {self.url} closed the console stream (it is shutting down).",
                                    _LOST_HINT)

    async def _poll_metrics(self) -> AsyncIterator[StatsSnapshot]:
        """One StatsSnapshot per poll of /metrics; EngineUnavailable after 3 failed polls in a row."""
        from lm_console.client.vllm_metrics import MetricsSampler, parse_metrics

        sampler = MetricsSampler()
        sampler.num_total_blocks = self.info.num_blocks
        failures = 0
        path = "/metrics" if self.has_metrics else "/v1/models"  # without metrics: a liveness probe
        while not self._closed.is_set():
            try:
                response = await self._request("GET", path)
                raise_for_status(self.url, response.status_code, response.content)
                failures = 0
                if self.has_metrics:
                    sample = sampler.sample(parse_metrics(response.text))
                    if self.event_map is not None:
                        sample.block_states = bytes(self.event_map.states)
                        sample.block_map_from_events = True
                    yield sample
            except (EngineUnavailable, RemoteRequestError, httpx.HTTPError, ValueError) as error:
                failures += 1
                if failures >= 3:
                    if isinstance(error, EngineUnavailable):
                        raise
                    raise EngineUnavailable(f"The server at {self.url} stopped answering {path}: {error}",
                                            _LOST_HINT) from error
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._closed.wait(), self.poll_interval_s)

    async def _zmq_events(self, endpoint: str) -> AsyncIterator[list[KVEventRecord]]:
        """vLLM's KV event PUB socket: (topic, seq, msgpack EventBatch) messages."""
        import zmq
        import zmq.asyncio

        from lm_console.events import records_of_message

        context = zmq.asyncio.Context()
        socket = context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            socket.connect(endpoint)
        except zmq.ZMQError as error:
            socket.close(linger=0)
            context.term()
            raise KVEventStreamError(f"cannot subscribe to {endpoint}: {error}") from error
        last_seq = -1
        try:
            while not self._closed.is_set():
                try:
                    if not await socket.poll(250):
                        continue
                    frames = await socket.recv_multipart()
                except zmq.ZMQError as error:
                    raise KVEventStreamError(f"the KV event socket {endpoint} failed: {error}") from error
                try:
                    records = records_of_message(frames)
                except ValueError as error:  # another producer's message we cannot read: count it, go on
                    self.num_kv_undecodable += 1
                    self.last_kv_decode_error = str(error)
                    continue
                self.num_kv_unknown += sum(record.is_unknown for record in records)
                if self.event_map is not None:
                    self.event_map.apply(records)
                if records:
                    seq = records[0].seq  # the publisher's batch number
                    self._count_gap(last_seq, seq)
                    last_seq = seq
                    yield records
        finally:
            socket.close(linger=0)
            context.term()

    def _count_gap(self, last_seq: int, seq: int) -> None:
        """Count the KV batches lost between two received ones (their seq numbers, no gaps when none is)."""
        if last_seq >= 0:
            self.num_kv_gaps += max(seq - last_seq - 1, 0)

    # -- requests -------------------------------------------------------------------------
    def generate(self, prompt: str | list[int], params: GenParams, request_id: str) -> AsyncIterator[StreamChunk]:
        body = {**sampling_body(params, self.served_model), "prompt": prompt}
        return self._stream("/v1/completions", body, request_id)

    def chat(self, messages: list[dict[str, Any]], params: GenParams, request_id: str) -> AsyncIterator[StreamChunk]:
        body = {**sampling_body(params, self.served_model), "messages": openai_messages(messages)}
        return self._stream("/v1/chat/completions", body, request_id)

    async def _stream(self, path: str, body: dict[str, Any], request_id: str) -> AsyncIterator[StreamChunk]:
        """Run the HTTP stream in a task, so abort() can close it from anywhere."""
        http = self._http()
        if request_id in self._requests:
            raise RemoteRequestError(f"Request id {request_id!r} is already running; use a new id.")
        queue: asyncio.Queue[StreamChunk | BaseException] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for chunk in stream_openai(http, self.url, path, body, request_id, {}):
                    queue.put_nowait(chunk)
            except asyncio.CancelledError:
                queue.put_nowait(StreamChunk(request_id, finished=True, finish_reason="abort"))
                raise
            except BaseException as error:  # noqa: BLE001 - handed to the reader
                queue.put_nowait(error)

        task = asyncio.get_running_loop().create_task(pump())
        self._requests[request_id] = task
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self._requests.pop(request_id, None)
            task.cancel()  # the reader left early: closing the connection aborts the request

    async def abort(self, request_id: str) -> None:
        """Close the request's stream (the server aborts it); its stream ends with 'abort'."""
        task = self._requests.get(request_id)
        if task is not None:
            task.cancel()

    async def reset_prefix_cache(self) -> bool:
        path = "/lmc/v1/reset_prefix_cache" if self.mode == LMC else "/reset_prefix_cache"
        response = await self._request("POST", path)
        if response.status_code == 404 and self.mode != LMC:
            raise RemoteRequestError("this server has no reset endpoint (vLLM: POST /reset_prefix_cache needs "
                                     "VLLM_SERVER_DEV_MODE=1)", 404)
        raise_for_status(self.url, response.status_code, response.content)
        if self.mode == LMC:
            return bool(response.json().get("reset"))
        return True

    # -- HTTP helpers ---------------------------------------------------------------------
    def _http(self) -> httpx.AsyncClient:
        if self.http is None:
            raise EngineUnavailable("The console is not attached to the server.", "Call start() first.")
        return self.http

    async def _request(self, method: str, path: str) -> httpx.Response:
        try:
            return await self._http().request(method, self.url + path)
        except httpx.TransportError as error:
            raise unreachable(self.url, error) from error

    async def _get_json_or_none(self, path: str) -> dict[str, Any] | None:
        """GET a JSON object; None when the route does not exist or is not JSON (another server)."""
        response = await self._request("GET", path)
        if response.status_code in (401, 403):
            raise EngineUnavailable(f"The server at {self.url} refused the API key (HTTP {response.status_code}): "
                                    f"{error_message(response.content, response.status_code)}", KEY_HINT)
        if response.status_code == 503:
            raise_for_status(self.url, 503, response.content)
        if response.status_code != 200:
            return None
        try:
            data = response.json()
        except ValueError:
            return None
        return data if isinstance(data, dict) else None

    async def _first_model(self) -> str | None:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError, EngineUnavailable):
            response = await self._request("GET", "/v1/models")
            if response.status_code == 200:
                return str(response.json()["data"][0]["id"])
        return None


