"""LoadGenerator: Poisson arrivals of random-token requests, some sharing a prefix, shaped live."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from lm_console.client.protocol import ConsoleClient
from lm_console.client.types import EngineUnavailable, GenParams
from lm_console.request_book import RequestBook

SHARE_STEPS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass(slots=True)
class LoadShape:
    """What the load looks like; every field can change while it runs."""

    rate: float = 1.0  # requests per second (Poisson)
    prompt_len: tuple[int, int] = (32, 192)  # uniform, in tokens (the shared prefix included)
    output_len: tuple[int, int] = (16, 96)
    shared_prefix_share: float = 0.5  # fraction of requests that start with a shared prefix
    prefix_len: int = 96  # tokens in each shared prefix
    num_prefixes: int = 2
    max_in_flight: int = 24  # bounds the queue, so a chat request never waits behind hundreds

    def describe(self) -> str:
        return (f"{self.rate:.2g} req/s · prompt {self.prompt_len[0]}-{self.prompt_len[1]} · "
                f"out {self.output_len[0]}-{self.output_len[1]} · shared prefix "
                f"{self.shared_prefix_share:.0%} of {self.prefix_len} tok")


class LoadGenerator:
    """Submits requests through a ConsoleClient while `running`; results go to a RequestBook."""

    def __init__(self, client: ConsoleClient, book: RequestBook, shape: LoadShape | None = None,
                 vocab_size: int = 32000, seed: int = 0, clock: Callable[[], float] = time.time) -> None:
        self.client = client
        self.book = book
        self.shape = shape or LoadShape()
        self.vocab_size = max(vocab_size, 200)
        self.rng = random.Random(seed)
        self.clock = clock
        self.running = False
        self.num_submitted = 0
        self.last_error: str | None = None
        self._ids = itertools.count()
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._prefixes = self._make_prefixes()

    # -- control (called from key bindings) -----------------------------------------------
    def start(self) -> None:
        self.running = True
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._arrivals())

    def stop(self) -> None:
        self.running = False

    def toggle(self) -> bool:
        self.stop() if self.running else self.start()
        return self.running

    def scale_rate(self, factor: float) -> None:
        self.shape.rate = min(max(self.shape.rate * factor, 0.1), 64.0)

    def cycle_share(self) -> None:
        index = min(range(len(SHARE_STEPS)), key=lambda i: abs(SHARE_STEPS[i] - self.shape.shared_prefix_share))
        self.shape.shared_prefix_share = SHARE_STEPS[(index + 1) % len(SHARE_STEPS)]

    def apply(self, shape: LoadShape) -> None:
        """Replace the shape (the prefixes are rebuilt when their length changes)."""
        rebuild = shape.prefix_len != self.shape.prefix_len or shape.num_prefixes != self.shape.num_prefixes
        self.shape = shape
        if rebuild:
            self._prefixes = self._make_prefixes()

    def submit_one(self) -> None:
        """Submit one request now (whatever the rate), e.g. to script a demo."""
        task = asyncio.get_running_loop().create_task(self._one(f"load-{next(self._ids):04d}"))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def cancel_all(self) -> None:
        """Stop arrivals and cancel every request task (without waiting for them)."""
        self.running = False
        if self._loop_task is not None:
            self._loop_task.cancel()
        for task in list(self._tasks):
            task.cancel()

    async def close(self) -> None:
        """Stop arrivals and abort what is in flight."""
        self.cancel_all()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    @property
    def num_in_flight(self) -> int:
        return len(self._tasks)

    # -- internals ------------------------------------------------------------------------
    def make_prompt(self) -> list[int]:
        """A random-token prompt; with probability shared_prefix_share it starts with a prefix."""
        shape = self.shape
        length = self.rng.randint(*shape.prompt_len)
        prompt: list[int] = []
        if self._prefixes and self.rng.random() < shape.shared_prefix_share:
            prompt = list(self.rng.choice(self._prefixes))[:max(length - 1, 1)]
        return prompt + [self.rng.randrange(100, self.vocab_size) for _ in range(length - len(prompt))]

    def _make_prefixes(self) -> list[list[int]]:
        rng = random.Random(1234)
        return [[rng.randrange(100, self.vocab_size) for _ in range(self.shape.prefix_len)]
                for _ in range(self.shape.num_prefixes)]

    async def _arrivals(self) -> None:
        while self.running:
            await asyncio.sleep(self.rng.expovariate(max(self.shape.rate, 1e-3)))
            if self.running and len(self._tasks) < self.shape.max_in_flight:
                self.submit_one()

    async def _one(self, request_id: str) -> None:
        prompt = self.make_prompt()
        params = GenParams(temperature=0.8, top_p=0.95, max_tokens=self.rng.randint(*self.shape.output_len),
                           seed=self.rng.randrange(1 << 30), ignore_eos=True)
        self.book.submit(request_id, "load", self.clock(), len(prompt), prompt=prompt)
        self.num_submitted += 1
        try:
            async for chunk in self.client.generate(prompt, params, request_id):
                self.book.on_chunk(chunk, self.clock())
        except asyncio.CancelledError:
            self.book.on_error(request_id, "cancelled", self.clock())
            try:
                await self.client.abort(request_id)
            except Exception:  # noqa: BLE001 - best effort while shutting down
                pass
            raise
        except EngineUnavailable:
            self.running = False
            self.book.on_error(request_id, "engine unavailable", self.clock())
        except Exception as error:  # noqa: BLE001 - one bad request must not stop the load
            self.last_error = f"{type(error).__name__}: {error}"
            self.book.on_error(request_id, self.last_error, self.clock())
