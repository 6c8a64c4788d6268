"""The OpenAI-style HTTP front end of one engine replica (`ditserve serve`).

Modules: ``config`` (ServerConfig and the YAML ``server:`` section), ``schemas`` (request
bodies -> SamplingParams, responses), ``errors`` (OpenAI-style error JSON), ``auth``,
``metrics`` (Prometheus), ``streaming`` (Server-Sent Events progress), ``app`` (the FastAPI
routes and lifespan) and ``main`` (CLI flags, uvicorn, SIGTERM drain).
"""
