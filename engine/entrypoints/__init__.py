"""Network entrypoints of the engine: the OpenAI-compatible HTTP server (openai/)."""
