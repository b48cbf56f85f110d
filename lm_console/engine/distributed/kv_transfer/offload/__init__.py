"""LMCache-style KV offload: chunk hashes, a CPU RAM tier, a disk tier, and the OffloadConnector."""
