"""Entrypoints over AsyncLLM: the OpenAI-compatible server and the console stream."""
