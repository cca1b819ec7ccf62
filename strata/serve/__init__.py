"""OpenAI-compatible HTTP server over the strata engine (`python -m strata.serve`).

Layout: `protocol` (wire format, validation, chat template), `worker` (the engine process),
`supervisor` (starts, feeds and restarts the engine process), `metrics` (Prometheus text),
`app` (FastAPI routes), `server` (uvicorn), `__main__` (the Hydra entry point).
The engine never imports this package.
"""
