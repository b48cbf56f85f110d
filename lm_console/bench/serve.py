"""`lmc bench serve`: requests at a rate (Poisson or gamma) and vLLM's serving metrics.

run_requests() drives any sender: engine_sender() goes straight to AsyncLLM in this process
(`--in-process`: what a server's engine loop sees, without HTTP); bench/http.py's sender goes
over HTTP to an OpenAI-compatible server, as `vllm bench serve` does.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lm_console.bench.datasets import BenchRequest
from lm_console.bench.report import header, line, section

METRIC_HEADERS = {"ttft": ("TTFT", "Time to First Token"),
                  "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
                  "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}


@dataclass(slots=True)
class RequestResult:
    """What the client saw of one request (seconds, perf_counter clock)."""

    prompt_len: int
    start_time: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_len: int = 0
    generated_text: str = ""
    success: bool = False
    error: str = ""
    queue_time: float = 0.0  # waiting for a --max-concurrency slot (vLLM: client_queue_time)
    arrival_time: float = 0.0  # when it arrived, before any --max-concurrency wait (--save-trace)

    def record_tokens(self, now: float) -> None:
        """Tokens arrived at `now`: the first sets TTFT, later ones add an inter-token latency."""
        if not self.token_times:
            self.ttft = now - self.start_time
        else:
            self.itl.append(now - self.token_times[-1])
        self.token_times.append(now)


async def arrivals(requests: list[BenchRequest], rate: float, burstiness: float, seed: int,
                   offsets: list[float] | None = None) -> AsyncIterator[tuple[int, BenchRequest]]:
    """Yield requests at `rate` per second: gamma intervals (shape = burstiness; 1 is Poisson).

    With `offsets` (a replayed trace), request i arrives offsets[i] seconds after the first instead.
    """
    if offsets is not None:
        # Against the start, not the previous arrival: a late wake-up does not push the rest late.
        start = time.perf_counter()
        for index, request in enumerate(requests):
            delay = start + offsets[index] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            yield index, request
        return
    rng = np.random.default_rng(seed)
    for index, request in enumerate(requests):
        yield index, request
        if math.isinf(rate) or index == len(requests) - 1:
            continue
        await asyncio.sleep(float(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness))))


Send = Callable[[int, BenchRequest, RequestResult], Awaitable[None]]


def engine_sender(llm: Any) -> Send:
    """Send one request straight to AsyncLLM.generate (streaming deltas), filling its result."""
    from lm_console.engine.sampling_params import RequestOutputKind, SamplingParams

    async def send(index: int, request: BenchRequest, result: RequestResult) -> None:
        params = SamplingParams(temperature=1.0, top_p=1.0, seed=index, max_tokens=request.output_len,
                                ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        result.start_time = last = time.perf_counter()
        async for output in llm.generate({"prompt_token_ids": request.prompt_token_ids}, params,
                                         request_id=f"bench-{index}"):
            now = time.perf_counter()
            completion = output.outputs[0]
            if completion.token_ids:
                result.record_tokens(now)
                last = now
            result.output_len += len(completion.token_ids)
            result.generated_text += completion.text
        result.latency = last - result.start_time
        result.success = result.output_len > 0
        if not result.success:
            result.error = "no tokens generated"

    return send


async def run_serve(llm: Any, requests: list[BenchRequest], rate: float, burstiness: float,
                    max_concurrency: int | None, seed: int = 0,
                    progress: bool = True) -> tuple[list[RequestResult], float]:
    """Send every request through llm.generate (in this process); results in input order."""
    return await run_requests(engine_sender(llm), requests, rate, burstiness, max_concurrency, seed, progress)


async def run_requests(send: Send, requests: list[BenchRequest], rate: float, burstiness: float,
                       max_concurrency: int | None, seed: int = 0, progress: bool = True,
                       offsets: list[float] | None = None) -> tuple[list[RequestResult], float]:
    """Send every request with `send` at the arrival rate (or at `offsets`, a trace's pace); results
    in input order, and the duration."""
    from tqdm.auto import tqdm

    bar = tqdm(total=len(requests), file=sys.stderr, disable=not progress, desc="Requests")
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results = [RequestResult(r.prompt_len) for r in requests]

    async def one(index: int, request: BenchRequest) -> None:
        result = results[index]
        arrived = result.arrival_time = time.perf_counter()
        if limit is not None:
            await limit.acquire()
        result.queue_time = time.perf_counter() - arrived
        try:
            await send(index, request, result)
        except Exception as error:  # noqa: BLE001 - a failed request is counted, not fatal
            result.success = False
            result.error = result.error or f"{type(error).__name__}: {error}"
        finally:
            if limit is not None:
                limit.release()
            bar.update(1)

    start = time.perf_counter()
    tasks = []
    async for index, request in arrivals(requests, rate, burstiness, seed, offsets):
        tasks.append(asyncio.create_task(one(index, request)))
    await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    return results, duration


def serve_metrics(results: list[RequestResult], duration: float, percentile_metrics: list[str],
                  percentiles: list[float]) -> dict[str, Any]:
    """vLLM's serve result keys (ms for latencies) from the per-request results."""
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    values = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }
    peak_tokens, peak_concurrency = _peaks(ok)
    metrics: dict[str, Any] = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_input, "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration, "request_goodput": None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "input_lens": [r.prompt_len for r in results], "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
        "latencies": [r.latency for r in results], "start_times": [r.start_time for r in results],
        "generated_texts": [r.generated_text for r in results], "errors": [r.error for r in results],
        "queue_times": [r.queue_time for r in results],
        "max_output_tokens_per_s": peak_tokens, "max_concurrent_requests": peak_concurrency, "rtfx": 0.0,
    }
    for name in percentile_metrics:
        data = values[name] or [0.0]
        metrics[f"mean_{name}_ms"] = float(np.mean(data)) * 1000
        metrics[f"median_{name}_ms"] = float(np.median(data)) * 1000
        metrics[f"std_{name}_ms"] = float(np.std(data)) * 1000
        for p in percentiles:
            metrics[f"p{_p_word(p)}_{name}_ms"] = float(np.percentile(data, p)) * 1000
    return metrics


def serve_summary(metrics: dict[str, Any], max_concurrency: int | None, rate: float,
                  percentile_metrics: list[str], percentiles: list[float]) -> list[str]:
    """vLLM's 'Serving Benchmark Result' block."""
    lines = [header("Serving Benchmark Result"),
             line("Successful requests:", metrics["completed"]),
             line("Failed requests:", metrics["failed"])]
    if max_concurrency is not None:
        lines.append(line("Maximum request concurrency:", max_concurrency))
    if not math.isinf(rate):
        lines.append(line("Request rate configured (RPS):", float(rate)))
    lines += [
        line("Benchmark duration (s):", float(metrics["duration"])),
        line("Total input tokens:", metrics["total_input_tokens"]),
        line("Total generated tokens:", metrics["total_output_tokens"]),
        line("Request throughput (req/s):", float(metrics["request_throughput"])),
        line("Output token throughput (tok/s):", float(metrics["output_throughput"])),
        line("Peak output token throughput (tok/s):", float(metrics["max_output_tokens_per_s"])),
        line("Peak concurrent requests:", float(metrics["max_concurrent_requests"])),
        line("Total token throughput (tok/s):", float(metrics["total_token_throughput"])),
    ]
    for name in percentile_metrics:
        short, title = METRIC_HEADERS[name]
        lines += [section(title), line(f"Mean {short} (ms):", float(metrics[f"mean_{name}_ms"])),
                  line(f"Median {short} (ms):", float(metrics[f"median_{name}_ms"]))]
        lines += [line(f"P{_p_word(p)} {short} (ms):", float(metrics[f"p{_p_word(p)}_{name}_ms"]))
                  for p in percentiles]
    lines.append("=" * 50)
    return lines


def _p_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def _peaks(results: list[RequestResult]) -> tuple[float, int]:
    """Most output tokens in one wall-clock second, and most requests in flight then."""
    if not results:
        return 0.0, 0
    origin = min(r.start_time for r in results)
    end = max(r.start_time + r.latency for r in results)
    num_bins = int(end - origin) + 1
    tokens = [0] * num_bins
    for r in results:
        for t in r.token_times:
            tokens[int(t - origin)] += 1
    peak_bin = max(range(num_bins), key=tokens.__getitem__)
    mid = origin + peak_bin + 0.5
    concurrency = sum(1 for r in results if r.start_time <= mid <= r.start_time + r.latency)
    return float(tokens[peak_bin]), concurrency
