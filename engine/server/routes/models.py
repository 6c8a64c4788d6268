"""GET /v1/models and GET /v1/models/{id}: the served model and its LoRA adapters, in
OpenAI's model format (an adapter's card has ``parent``: the base model, and ``root``: its
file, as vLLM lists LoRA modules)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Request

from ditserve.engine.server import openapi
from ditserve.engine.server.auth import require_api_key
from ditserve.engine.server.errors import APIError, shown

CREATED = int(time.time())

router = APIRouter(dependencies=[Depends(require_api_key)])


def model_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": CREATED, "owned_by": "ditserve"}


def adapter_cards(request: Request) -> list[dict[str, Any]]:
    server = request.app.state.server
    catalog = getattr(server.engine, "adapters", None)
    return [model_card(entry.name) | {"parent": server.model_name, "root": entry.path}
            for entry in (catalog.entries() if catalog is not None else ())]


@router.get("/v1/models", response_model=None, summary="The served model and its adapters",
            responses=openapi.answers(openapi.json_answer("ModelList")))
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(request.app.state.server.model_name),
                                       *adapter_cards(request)]}


@router.get("/v1/models/{model_id:path}", response_model=None, summary="One model by id",
            responses=openapi.answers(openapi.json_answer("Model"), 404))
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    name = request.app.state.server.model_name
    adapter = next((c for c in adapter_cards(request) if c["id"] == model_id), None)
    if adapter is not None:
        return adapter
    if model_id != name:
        raise APIError(404, f"model {shown(model_id)} does not exist; this server serves "
                            f"{name!r}", param="model", code="model_not_found",
                       reason="model_not_found")
    return model_card(name)
