"""The OpenAI-style HTTP front end of one engine replica (`ditserve serve`).

Modules: ``config`` (ServerConfig and the YAML ``server:`` section), ``schemas`` (request
bodies -> SamplingParams), ``responses`` (images answers, usage, stream event payloads),
``errors`` (OpenAI-style error JSON), ``edge`` (request ids, body limit, HEAD, the generic 500),
``openapi`` (the OpenAPI document), ``auth``, ``metrics`` (Prometheus), ``streaming`` (Server-Sent
Events), ``phase`` (the engine's lifecycle as the routes read it), ``model_defaults``, ``state``
(what the routes share), ``routes/`` (one module per route group), ``app`` (assembles the
FastAPI app and its lifespan) and ``main`` (CLI flags, uvicorn, SIGTERM drain).
"""
