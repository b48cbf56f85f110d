"""The OpenAI-compatible server (vLLM's API shapes): `build_app(engine, settings)`, `run_server`.

Modules: settings (ServerSettings), protocol / protocol_chat (request and response models),
errors (OpenAI-shaped errors and the engine-error mapping), auth (require_api_key), gate (the
body limit, drain and dead-engine gate), media (image URLs), serving_* (the endpoints),
metrics (Prometheus with vLLM's names), api_server (the app, drain, engine watchdog).
FastAPI, uvicorn, prometheus-client and httpx come with the `serve` extra.
"""
