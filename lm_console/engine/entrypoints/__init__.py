"""Network entrypoints over AsyncLLM: the OpenAI-compatible HTTP server (openai/) and the console stream
(console_stream.py, console_hub.py, console_protocol.py: `/lmc/v1/...`, mounted by that server)."""
