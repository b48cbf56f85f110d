"""Per-tier counters of the offload store (cumulative; the console turns them into rates)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TierCounters:
    """hits/misses count lookups of single chunks; bytes_in were stored, bytes_out loaded."""

    hits: int = 0
    misses: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    evictions: int = 0
    errors: int = 0  # corrupt chunks found, failed writes
