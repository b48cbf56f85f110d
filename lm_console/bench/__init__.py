"""`lmc bench`: throughput (offline), serve (AsyncLLM at a request rate) and prefix (cache on/off)."""
