"""Request traces: what `lmc bench serve --save-trace` records and `--replay-trace` replays.

A Mooncake-style JSONL trace, one request a line, in arrival order:

    {"timestamp": 1250, "input_length": 130, "output_length": 24, "hash_ids": [0, 1]}

`timestamp` is the arrival in milliseconds since the first request's; `hash_ids` names the
prompt's blocks of HASH_BLOCK tokens, chained as prefix-cache hashes are (a block's id stands for
it and every block before it), so two prompts that share a prefix share the ids of its blocks.
That is all a replay needs: prompts of the same lengths with the same shared prefixes (each block
rebuilt from its id as random tokens; the tokens themselves are not kept, so a trace carries no
user text), the same output lengths, sent at the recorded pace.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from lm_console.bench.datasets import BenchRequest

HASH_BLOCK = 512  # tokens per hash id (Mooncake's traces use 512)


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names the line."""


@dataclass(slots=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int]

    def as_dict(self) -> dict[str, object]:
        return {"timestamp": self.timestamp_ms, "input_length": self.input_length,
                "output_length": self.output_length, "hash_ids": self.hash_ids}


def block_hash_ids(prompts: list[list[int]], block: int = HASH_BLOCK) -> list[list[int]]:
    """Each prompt's chained block ids: equal ids <=> equal blocks after equal prefixes."""
    ids: dict[tuple[int, tuple[int, ...]], int] = {}
    out = []
    for prompt in prompts:
        parent, chain = -1, []
        for start in range(0, len(prompt), block):
            key = (parent, tuple(prompt[start:start + block]))
            parent = ids.setdefault(key, len(ids))
            chain.append(parent)
        out.append(chain)
    return out


def trace_of(requests: list[BenchRequest], arrivals: list[float], output_lens: list[int]) -> list[TraceRecord]:
    """The trace of requests that arrived at `arrivals` (seconds, any clock) and generated output_lens tokens."""
    if not requests:
        return []
    order = sorted(range(len(requests)), key=lambda i: arrivals[i])
    first = arrivals[order[0]]
    hashes = block_hash_ids([requests[i].prompt_token_ids for i in order])
    return [TraceRecord(round((arrivals[i] - first) * 1000.0, 3), requests[i].prompt_len, output_lens[i], chain)
            for i, chain in zip(order, hashes)]


def save_trace(path: str | Path, records: list[TraceRecord]) -> None:
    with open(path, "w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(record.as_dict()) + "\n")


def load_trace(path: str | Path) -> list[TraceRecord]:
    """Read a JSONL trace (Mooncake's keys); TraceError naming the line that is wrong."""
    records = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise TraceError(f"cannot read the trace {path}: {error.strerror or error}") from error
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            record = TraceRecord(float(data["timestamp"]), int(data["input_length"]), int(data["output_length"]),
                                 [int(h) for h in data.get("hash_ids") or []])
        except (ValueError, KeyError, TypeError) as error:
            raise TraceError(f"{path}:{number}: not a trace line ({type(error).__name__}: {error})") from error
        if record.input_length < 1 or record.output_length < 1 or record.timestamp_ms < 0:
            raise TraceError(f"{path}:{number}: lengths must be >= 1 and the timestamp >= 0")
        records.append(record)
    if not records:
        raise TraceError(f"{path} holds no request")
    return sorted(records, key=lambda r: r.timestamp_ms)


def replay_requests(records: list[TraceRecord], vocab_size: int,
                    block: int = HASH_BLOCK) -> tuple[list[BenchRequest], list[float]]:
    """The requests of a trace and their arrival offsets (seconds after the first).

    A block's tokens depend only on its hash id, so shared prefixes stay shared; a prompt longer
    than its hash ids cover (or a trace without them) is completed with tokens of its own.
    """
    requests = []
    for index, record in enumerate(records):
        tokens: list[int] = []
        for hash_id in record.hash_ids:
            rng = random.Random(hash_id)
            tokens += [rng.randrange(100, vocab_size) for _ in range(block)]
        if len(tokens) < record.input_length:
            rng = random.Random(f"request-{index}")
            tokens += [rng.randrange(100, vocab_size) for _ in range(record.input_length - len(tokens))]
        requests.append(BenchRequest(tokens[:record.input_length], record.output_length))
    first = records[0].timestamp_ms if records else 0.0
    return requests, [(r.timestamp_ms - first) / 1000.0 for r in records]
