"""The API's routes, one module per route group, each exposing ``router`` (a FastAPI
APIRouter) that ``app.create_app`` includes: ``images`` (POST /v1/images/generations),
``models`` (GET /v1/models[/{id}]) and ``probes`` (/health, /ready, /metrics). A new group
(e.g. the /v1/videos jobs) is a new module here plus one ``include_router`` line.
"""
