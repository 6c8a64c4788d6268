"""The OpenAI-style HTTP front end of one engine replica (`ditserve serve`).

One package per endpoint family, each owning its routes (``routes.router``), its request
parsing and its OpenAPI parts, none importing another: ``images`` (POST
/v1/images/generations), ``edits`` (POST /v1/images/edits), ``videos`` (/v1/videos),
``adapters`` (the LoRA load and unload routes), ``models`` (GET /v1/models) and ``probes``
(/health, /ready, /metrics). What several of them share is below them: ``generation`` (the
image request of images and edits: body, waiting, answers), ``fields`` (request parsing every
endpoint shares: JSON bodies, the extension fields, adapters, step cache, forms, uploads),
``limits`` (what a request may ask), ``state`` (what the routes share: engine, config,
metrics), ``jobs`` (the video job store), ``phase`` (the engine's lifecycle as the routes
read it: admission's 503s and 429s), ``errors`` (OpenAI-style error JSON), ``edge`` (request
ids, body limit, HEAD, the generic 500), ``auth``, ``streaming`` (Server-Sent Events),
``openapi`` (the document and its shared parts), ``metrics`` (Prometheus) and
``model_defaults``. On top: ``app`` (assembles the FastAPI app and its lifespan) and ``main``
(``options``' CLI flags, ``config``, uvicorn with ``protocol``, SIGTERM drain). The layers are
an import-linter contract (pyproject.toml).
"""
