"""Distributed pieces of the engine: KV transfer (connectors, offload tiers)."""
